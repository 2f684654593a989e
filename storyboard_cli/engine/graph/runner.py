"""GraphRunner: the whole denoising step (CFG doubling, ControlNet, UNet, guidance, sampler update)
captured as one CUDA graph per shape, replayed once per step. The only file that names CUDA graphs: the rest of the
package drives the runner through the Engine protocol, and capture and the bench read what it did through its public
methods (`shape_key`, `stats_of`, `stats`, `describe`, `feature_mb`).

- Static input buffers (`Buffers`, engine/graph/buffers.py) are allocated once, at the largest batch and latent size
  the job needs, and sliced per shape; every value that changes between steps or batches (latents,
  sigma/timestep and sampler coefficients, embeds, time ids, guidance, each conditioning kind's tensors)
  lives in them. Nothing that varies is baked into a graph.
- The step index is a device tensor the graph itself increments, and the sampler's coefficients are
  a device table the graph indexes, so a 30-step loop is 30 replays and nothing else (plus one
  noise copy per step for ancestral samplers). No host sync inside the loop.
- Graphs are captured lazily (or ahead, by `prepare`), largest first, into ONE shared memory pool,
  after a warm-up on a side stream (a compiled graph's at the fewest rows its artifact takes: any rows load its
  kernels), unless a graph already captured ran every kernel of this one (`Warmed`: draft mode's kinds of a shape,
  a conditional step of B rows after a guided step of B / 2 images, a compiled graph of the size at other rows); a
  capture that fails after less than a warm-up at its rows is tried again after one. The first replay of
  each is checked against the eager step on the same inputs (a compiled graph whose kernels were checked so at other
  rows: against its own step outside the graph, `_check`, and that replay is its batch's first step, `_first_step`,
  whose reference is the step of the batch's first image alone, `part_step`);
  a capture failure or a mismatch sends that shape down the variant table (engine/variants.py: FP8 -> compiled ->
  plain -> eager), with the reason.
- Draft mode's step kinds (steps.StepKind: the conditional rows alone after the guidance cut-off or at
  guidance <= 1; DeepCache's full step writing its feature and its shallow step reading it) are more
  graphs of the same shape, in the same pool, over the same static buffers (the feature has one more):
  the plan is fixed before the loop, so the host picks each step's graph and the loop stays replays only.
  Where a shape has DeepCache's full step, today's step of the same rows is that graph (`writers`): one capture
  less, the same result to the bit (the feature's copy is on the side).
- Beside the loop (`ahead`): a graph that needs no warm-up (a graph before it ran its kernels) is captured between
  the replays of the batch before its own, from the thread that queues them, while the GPU still runs the replays
  queued so far (`Pace`: with `AHEAD_REPLAYS` of them queued, or the launch queue full): no sync, no memory
  released, the step index left alone (the loop in flight reads it), capture errors kept to this thread. A compiled
  graph that needs one gets its warm-up there first (`_warm_beside`), at its artifact's fewest rows on scratch
  buffers of its own, so the host's setup of new shapes (cuDNN's plans) runs beside the replays too.
  `prepare(beside=True)` leaves those graphs to it. The first batch's graph, where its kernels were checked against
  the eager step at other rows, is captured beside its own batch's first `OWN_STEPS` steps, which run on the same
  kernels outside the graph (`_behind`): they are its warm-up, at its rows, and the GPU runs them while the host
  records the graph; its first replay is checked against its first image's step alone. The batches after the next one get
  `Spare` pieces (`ahead(spare=True)`, run/batch.py `spare_captures`): run while the loop has room, dropped at its
  end. A capture on a
  second thread waited for the replays' launches (the launch queue is full): benchmarks/probes/capture_thread.py.
- Compiled kernels (engine/kernels/) are looked at between batches: a size whose kernels became
  ready since the last batch gets a compiled graph from its next batch on.
- A shape larger than the buffers grows them (`ensure_capacity`); that drops the graphs captured so
  far, which are captured again on use.
"""

from __future__ import annotations

import gc
import logging
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from typing import Callable, Iterator

import torch

from storyboard_cli.engine.base import Shape, run_between
from storyboard_cli.engine.conditioning import Cond
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.device import dtype_name, indexed
from storyboard_cli.engine.eager import EagerEngine, sample_step
from storyboard_cli.engine.graph.buffers import Buffers, Views
from storyboard_cli.engine.graph.check import first_replay, first_step, first_step_of_part
from storyboard_cli.engine.graph.keys import GraphStats, ShapeKey, Warmed
from storyboard_cli.engine.graph.ledger import CheckLedger
from storyboard_cli.engine.graph.pace import Pace
from storyboard_cli.engine.kernels.calls import CompiledKernels
from storyboard_cli.engine.kernels.export import MAX_ROWS, MIN_ROWS
from storyboard_cli.engine.kernels.plans import Plans, make
from storyboard_cli.engine.sampling import Schedule
from storyboard_cli.engine.variants import EAGER, PLAIN, VARIANTS
from storyboard_cli.errors import one_line
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.steps import FULL, StepKind, StepPlan


log = logging.getLogger(__name__)
# eager steps on a side stream before a capture: one does the lazy inits (kernel modules, library handles, a
# compiled artifact's kernels) for the shapes it runs; a second cost a whole step per graph (a draft render captures
# 35) and changed nothing the GPU tests see (every kind captured and checked against eager)
WARMUP_STEPS = 1
# the steps a graph's own batch runs on its kernels outside the graph while the graph is captured beside them
# (`_behind`): the first is the warm-up (the libraries' setup at its rows, the host's, with the GPU running what the
# host has launched), the second is queued while the first runs, and the capture's host time hides behind both on the
# GPU (two steps of an 8 x 1024² batch: 0.35-0.5 s)
OWN_STEPS = 2


class GraphRunner:
    name = "graph"

    def __init__(self, models: SdxlModels, max_batch: int = 1, max_hw: tuple[int, int] = (64, 64),
                 compiled: CompiledKernels | None = None, ledger: CheckLedger | None = None):
        """`compiled`: compiled module calls (engine/kernels/calls.py) for the shapes whose kernels are ready;
        those shapes get ShapeKey.variant "fp8" (--fp8) or "compiled" (fp16), the best the kernels loaded so far
        offer; a variant that fails its check falls back along engine/variants.py, the last graph to "plain".
        `ledger`: the checks against the eager step that earlier runs made on the same kernels, weights and machine
        (engine/graph/ledger.py), read and written; None: every run checks against the eager step once."""
        self.models, self.compiled, self.ledger = models, compiled, ledger
        self.demoted: dict[Shape, set[str]] = {}  # the variants of a shape that failed (capture or check)
        self.eager = EagerEngine(models)  # the fallback, and what a first replay is checked against (`_check`)
        self.pool = None  # one memory pool shared by every graph, made at the first capture
        self.side: torch.cuda.Stream | None = None  # the warm-ups' stream, made at the first
        self.graphs: dict[ShapeKey, torch.cuda.CUDAGraph] = {}
        self.stats: dict[ShapeKey, GraphStats] = {}
        self.warmed: list[Warmed] = []  # what earlier warm-ups and captures ran (kept when graphs are released)
        # the library calls each warm-up made, and the pieces that plan them at a graph's rows before its capture
        # beside a loop (engine/kernels/plans.py)
        self.plans = Plans(models.device.type == "cuda", None if ledger is None else ledger.plans_path,
                           str(indexed(models.device)))  # a kept record's calls are made on this device
        # compiled graphs whose first replay matched the eager step, and the weights' writes then (`_check`)
        self.against_eager: list[tuple[ShapeKey, int]] = []
        # DeepCache's full steps by (shape, guided): today's step of that shape and rows replays the same graph (one
        # capture less; it also writes the feature, a copy nothing reads until a full step of a caching batch
        # writes it again)
        self.writers: dict[tuple[Shape, bool], StepKind] = {}
        # the seams a test (or another capture backend) replaces: ShapeKey -> captured graph, or raises; and the step
        # every warm-up and capture runs on a graph's buffers (`step`; a test wraps it to break or probe a capture)
        self.capturer: Callable[[ShapeKey], object] = self._capture
        self.stepper: Callable[[Views], None] = self.step
        self.pace: Callable[[bool], Pace] = Pace  # a loop's pacing of its `between` pieces (a test's seam)
        # a capture beside the loop before (`ahead`): Views -> captured graph, or raises; and whether one can run now
        self.beside_recorder: Callable[[Views], object] = self._record_beside
        self.beside_ready: Callable[[], bool] = self._beside_ready
        self.beside_warmer: Callable[[ShapeKey], None] = self._warm_on_scratch  # a warm-up there (`_warm_beside`)
        self._warmed_beside: set[ShapeKey] = set()  # warmed up beside a loop, their capture still to come
        self._not_behind: set[ShapeKey] = set()  # whose capture beside their own first steps failed (`_behind`)
        self._spent = (0.0, 0.0)  # the last capture's warm-up and end-of-capture seconds (`_record`)
        self._looping = ""  # the label of the graph whose loop runs now (`sample`): what a capture beside it names
        self._allocate(max_batch, max_hw[0] * max_hw[1])

    def _allocate(self, max_batch: int, max_pixels: int) -> None:
        self.buf = Buffers(self.models, max_batch, max_pixels)
        if self.compiled is not None:
            self.compiled.reserve(max_batch, max_pixels)

    @property
    def max_batch(self) -> int:
        return self.buf.max_batch

    @property
    def max_pixels(self) -> int:
        return self.buf.max_pixels

    def ensure_capacity(self, shapes: list[Shape]) -> None:
        """Grows the static buffers to fit every shape. Graphs hold pointers into the old buffers, so
        growing drops every graph captured so far (and the pool): they are captured again on use."""
        if all(self.buf.fits(s) for s in shapes):
            return
        if self.graphs:
            log.info("static buffers grow: %d captured graphs are dropped and captured again", len(self.graphs))
            self.release("dropped: the static buffers grew")
        self._allocate(max([self.max_batch] + [s.batch for s in shapes]),
                       max([self.max_pixels] + [s.height * s.width for s in shapes]))

    def shape_key(self, batch: int, height: int, width: int, control: bool, step: StepKind = FULL) -> ShapeKey:
        """Compiled kernels where the size has them and the step is the whole UNet over rows the artifacts
        take (a conditional step runs B rows); DeepCache's steps call into the UNet's blocks: plain. A step after
        a batch's ControlNet has ended is the step of a batch without one: one graph serves both."""
        if control and not step.control:
            control, step = False, replace(step, control=True)
        shape = Shape(batch, height, width, control)
        rows = 2 * batch if step.guided else batch
        variant = PLAIN
        if self.compiled is not None and not step.cache and MIN_ROWS <= rows <= MAX_ROWS:
            failed = self.demoted.get(shape, set())
            variant = next((v for v in self.compiled.variants(*shape) if v not in failed), PLAIN)
        if variant == PLAIN and not step.cache:  # a plain step whose DeepCache twin the runner captures: that graph
            step = self.writers.get((shape, step.guided), step)
        return ShapeKey(*shape, dtype_name(self.models.dtype), variant, step)

    def _share(self, shape: Shape, kinds) -> None:
        """Registers the DeepCache full steps among `kinds` (for `shape`): from now on today's step of the same
        rows and ControlNet is that graph (shape_key)."""
        for kind in kinds:
            if kind.cache == "write":
                key = self.shape_key(*shape, kind)  # a step after the ControlNet's end: the shape without one
                self.writers.setdefault((key.shape, kind.guided), key.step)

    def can_run(self, shape: Shape) -> bool:
        """Whether `shape` replays a graph (it has not fallen back to eager)."""
        stats = self.stats_of(shape)
        return self.models.device.type == "cuda" and (stats is None or stats.state != EAGER)

    def stats_of(self, shape: Shape, kind: StepKind = FULL) -> GraphStats | None:
        """The stats of the graph `shape`'s step of `kind` runs on now (None before its first capture)."""
        return self.stats.get(self.shape_key(*shape, kind))

    def feature_mb(self) -> float:
        """MB of DeepCache's feature buffer (0 while no graph caches)."""
        feature = self.buf.feature
        return 0.0 if feature is None else feature.numel() * feature.element_size() / 2**20

    # ------------------------------------------------------------------ the captured step

    def step(self, v: Views) -> None:
        """One step on the static buffers of `v.key`'s graph: what its warm-up runs and its capture records."""
        index = v.buf.index  # the static buffers' (a warm-up beside the loop: its scratch buffers')
        row = v.buf.table.index_select(0, index).squeeze(0)  # [6]: sigma, t, a, b, c, s
        calls = None if v.key.variant == PLAIN else self.compiled.calls_for(v.key.variant)
        conds = v.conds.at(index)  # the kinds' tensors at this step (a ControlNet's scale times its keep)
        x_next, denoised = sample_step(self.models, v.x, v.prev, v.noise, row, v.cond, conds, v.guidance,
                                       calls, v.key.step, v.feature, index)
        v.x.copy_(x_next)
        v.prev.copy_(denoised)
        index.add_(1)

    def part_step(self, v: Views, x: torch.Tensor, noise: torch.Tensor | None, n: int, i: int = 0,
                  prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `i` of `v.key`'s graph for the batch's first `n` images alone, outside the graph, on tensors of their
        own: `x` the batch's latents at that step, `prev` its prediction of the step before (None at the first step),
        `noise` that step's; the text, guidance and kinds read from `v`, loaded with the batch (the replay leaves them
        as they are). (next latents, prediction)."""
        key, b = v.key, v.key.batch
        calls = None if key.variant == PLAIN else self.compiled.calls_for(key.variant)
        zero = torch.zeros_like(x[:n])
        return sample_step(self.models, x[:n].clone(), zero if prev is None else prev[:n].clone(),
                           zero if noise is None else noise[:n].clone(), self.buf.table[i], v.cond.first_images(n, b),
                           v.conds.first_images(n, b).at(i), v.guidance[:n].clone(), calls, key.step, None, i)

    def _capture(self, key: ShapeKey) -> torch.cuda.CUDAGraph:
        if self.models.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        v = self.buf.view(key)
        stats = self.stats.setdefault(key, GraphStats(key))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # torch.cuda.graph empties the cache too: measure the pool from there
        reserved = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        ran = Warmed.of(key)
        stats.warmup = not any(w.covers(ran) for w in self.warmed)
        small = self._fewest_rows(key) if stats.warmup else None
        try:
            graph = self._record(v, stats.warmup, small)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - a lazy init the skipped warm-up would have done: once more with it
            if stats.warmup and small is None:
                raise
            before = "after a warm-up at fewer rows" if stats.warmup else "without a warm-up"
            log.warning("capturing %s %s failed (%s): again after a warm-up at its rows", key.label, before,
                        one_line(e, 200))
            stats.reason = f"captured after a warm-up at its rows: {before}, {one_line(e, 160)}"
            gc.collect()  # the failed graph: destroyed now, not by a collection during the next capture
            self._settle()
            stats.warmup, small = True, None
            graph = self._record(v, True)
        torch.cuda.synchronize()
        stats.warmup_rows = Warmed.of(key if small is None else small.key).rows if stats.warmup else 0
        stats.warmup_s, stats.end_s = self._spent
        self.warmed.append(ran)
        self.plans.made(*self._plan_id(key))
        stats.capture_s = time.perf_counter() - t0
        stats.pool_mb = (torch.cuda.memory_reserved() - reserved) / 2**20
        return graph

    def _fewest_rows(self, key: ShapeKey) -> Views | None:
        """Where a compiled graph's warm-up runs: the same kernels at the fewest rows the artifact takes (its rows are
        its one dynamic dimension, so any rows load every kernel of it, `Warmed.covers`), a fraction of the step at
        the batch's rows; None for a plain graph or one with a second ControlNet (modules whose kernels are chosen per
        shape) or a batch already that small."""
        if key.variant == PLAIN or key.control & ~1:  # a second ControlNet runs its module: kernels chosen per shape
            return None
        small = self._warm_key(key)
        return self.buf.view(small) if small.batch < key.batch else None

    @staticmethod
    def _warm_key(key: ShapeKey) -> ShapeKey:
        """A compiled graph's warm-up key: its artifact's fewest rows (`_fewest_rows`), or its own where it has
        fewer."""
        return replace(key, batch=min(key.batch, -(-MIN_ROWS // (2 if key.step.guided else 1))))

    def _record(self, v: Views, warmup: bool, small: Views | None = None) -> torch.cuda.CUDAGraph:
        """One step captured into the shared pool; `warmup`: eager steps on a side stream first (on `small`'s rows
        where given). Leaves the warm-up's and the end of capture's seconds in `_spent`."""
        t0 = time.perf_counter()
        if warmup:
            if self.side is None:  # one for every warm-up: a library handle's workspace is kept per stream (34 MB
                self.side = torch.cuda.Stream()  # of cuBLAS workspace each, measured as the pool growth of a capture)
            side = self.side
            side.wait_stream(torch.cuda.current_stream())
            ran = v if small is None else small
            with torch.cuda.stream(side):  # lazy inits outside the graph
                for _ in range(WARMUP_STEPS):
                    self.buf.index.zero_()
                    with self.plans.recording(*self._plan_id(ran.key)):
                        self.stepper(ran)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
        warmed = time.perf_counter()
        self.buf.index.zero_()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.stepper(v)
                body = time.perf_counter()
            self._spent = (warmed - t0, time.perf_counter() - body)
        except BaseException:
            graph = None  # now: the exception's traceback keeps this frame, and would keep the graph's memory
            self._after_failed_capture(stream)
            raise
        return graph

    def _after_failed_capture(self, stream: torch.cuda.Stream) -> None:
        """A capture that failed inside CUDA raises from the end of the capture, before torch restores the stream and
        before it ends the allocator's recording into the pool; while that records, every later capture into the
        pool fails ("already recording", seen on the H200 even after ending it by hand). The graphs captured so far
        keep the pool; later captures go to a new one (their memory is not shared with the old pool's). It also
        raises before the default CUDA generator leaves capture mode, after which every CUDA random op outside a
        capture fails ("Offset increment outside graph capture", benchmarks/probes/rng_trace.py): an empty capture
        ends it."""
        torch.cuda.set_stream(stream)
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None:
            try:
                end(torch.cuda.current_device(), self.pool)
            except Exception as e:  # noqa: BLE001 - it was not recording (the capture failed before it began)
                log.info("after a failed capture, the pool was not recording: %s", one_line(e, 160))
        self.pool = torch.cuda.graph_pool_handle()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty": it is meant to be
            empty = torch.cuda.CUDAGraph()
            with torch.cuda.graph(empty):
                pass

    def _fall_back(self, key: ShapeKey, reason: str) -> None:
        """`key`'s variant fails for its shape: the shape falls back along the table (engine/variants.py), to the next
        variant whose kernels are loaded (FP8 to fp16 compiled where loaded, then the plain graph), a plain graph to
        eager. `stats.state` names what it fell back to."""
        stats = self.stats.setdefault(key, GraphStats(key))
        self.graphs.pop(key, None)
        if not self.graphs:  # the pool died with its last graph: capturing into its handle again trips an allocator
            self.pool = None  # assert (use_count > 0, CUDACachingAllocator.cpp), seen when a first compiled graph fell back
        stats.state = VARIANTS[key.variant].fallback
        if stats.state != EAGER:
            self.demoted.setdefault(key.shape, set()).add(key.variant)
            stats.state = self.shape_key(*key.shape, key.step).variant  # the next row loaded for this size
        stats.reason = reason
        log.warning("graph %s falls back to %s: %s", key.label, stats.state, reason)

    def graph(self, key: ShapeKey) -> torch.cuda.CUDAGraph | None:
        """The graph for `key`, captured on first use; None if this shape has fallen back."""
        if key in self.graphs:
            return self.graphs[key]
        if self.stats.get(key) and self.stats[key].state not in ("pending", "graph", "released"):
            return None  # fell back (its state names to what)
        self.ensure_capacity([key.shape])
        if not self._bind(key):
            return None
        try:
            self.graphs[key] = self.capturer(key)
        except torch.cuda.OutOfMemoryError:
            # not this shape's fault: the caller releases memory and splits the batch (render's OOM policy)
            self.stats.setdefault(key, GraphStats(key)).reason = "out of memory at capture"
            raise
        except Exception as e:  # noqa: BLE001 - any capture failure: fall back for this shape, keep going
            self._settle()
            self._fall_back(key, f"capture failed: {one_line(e, 200)}")
            return None
        self._adopt(key)
        return self.graphs[key]

    def _bind(self, key: ShapeKey) -> bool:
        """Loads `key`'s kernels where they are not loaded yet (CompiledKernels.bind: deferred or spare), the seconds
        in its stats; False when one does not load: the graph has fallen back (`_fall_back`)."""
        if self._bound(key):
            return True
        t0 = time.perf_counter()
        ok = self.compiled.bind(key.variant, key.height, key.width, bool(key.control & 1))
        self.stats.setdefault(key, GraphStats(key)).load_s += time.perf_counter() - t0
        if not ok:
            self._fall_back(key, "its kernels did not load (the notes say why)")
        return ok

    def _adopt(self, key: ShapeKey) -> None:
        """`key`'s graph, just captured, is the one its shape replays: its state, and its kernels' build seconds."""
        stats = self.stats.setdefault(key, GraphStats(key))
        stats.state = "graph"
        if key.variant != PLAIN:
            stats.compile_s = self.compiled.compile_s(key.height, key.width)

    def _settle(self) -> None:
        if self.models.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def prepare(self, shapes: list[Shape], kinds: dict[Shape, set[StepKind]] | None = None,
                later: list[Shape] = (), beside: bool = False) -> None:
        """Sizes the buffers, loads the compiled kernels the cache has for these shapes, then captures ahead
        of time, largest first, so smaller graphs reuse the pool's blocks; last, the kernels the cache
        lacks start compiling in the background. Out of memory stops the captures: the shapes left are
        captured on first use (and their batches split if they must be). `kinds`: the step kinds a shape's
        batches run (draft mode); a shape not in it runs today's step (FULL). `later`: shapes that run after these
        (a render's hires passes): the buffers fit them now, so that their first capture drops no graph, and their
        kernels are wanted with the others'; they are captured on first use. `beside`: the caller hands each batch's
        `ahead` pieces to the loop before it, so the graphs that need no warm-up, other than the first shape's, are
        left to them (captured on first use where no piece ran)."""
        self.ensure_capacity([*shapes, *later])
        if self.compiled is not None:
            before = (len(self.compiled.load_s), len(self.compiled.deferred()))
            # `beside`: each graph's kernels are loaded before its capture, the later ones' beside a loop (`ahead`)
            self.compiled.want(self.compiled.targets([*shapes, *later]), defer=beside)
            if (len(self.compiled.load_s), len(self.compiled.deferred())) != before:  # the report says what they cost
                self.compiled.notes.append(self.compiled.load_note())
        for shape in shapes:
            self._share(shape, (kinds or {}).get(shape, ()))
        keys = {self.shape_key(*s, k) for s in shapes for k in (kinds or {}).get(s, {FULL})}
        first = {self.shape_key(*s, k) for s in shapes[:1] for k in (kinds or {}).get(s, {FULL})}
        # the most rows x pixels first (the pool's blocks are reused by what follows); at equal rows and size the
        # graphs whose kernels cover the others' first, so those skip their warm-up: a 4-image guided step before
        # an 8-image batch's conditional step, the ControlNet's before the plain one, a full step before a shallow
        own = beside and len(first) == 1 and self._can_capture_behind(*first)  # `_behind`, at its batch's `sample`
        for key in sorted(keys, key=self._capture_order, reverse=True):
            if beside and key not in first and (self._can_capture_beside(key) or self._can_warm_beside(key)):
                continue
            if own and key in first:
                continue
            try:
                self.graph(key)
            except torch.cuda.OutOfMemoryError:
                log.warning("out of memory capturing %s ahead of time; the rest is captured on use", key.label)
                break
        self._settle()  # outside the handler: the failed capture's memory is free by now
        if self.compiled is not None:
            self.compiled.start()

    def ahead(self, shape: Shape, kinds: set[StepKind], spare: bool = False) -> Iterator[Callable[[], object]] | None:
        """Pieces of `between` work (Engine.sample) that capture `shape`'s graphs of `kinds` (a batch that runs after
        the loop they go to), one graph each, where it can be captured beside that loop (`_can_capture_beside`), each
        after a piece that warms it up there where it needs that and can (`_can_warm_beside`); None when none can. Each
        piece looks again when it runs; what it leaves is captured on first use. `spare` (a batch after the next one):
        None while kernels of its size are still to be built, whose graph would replace one captured now."""
        if not self.beside_ready() or (spare and self._kernels_to_come(shape)):
            return None
        self._share(shape, kinds)
        keys = sorted({self.shape_key(*shape, k) for k in kinds}, key=self._capture_order, reverse=True)
        pieces = []
        for key in keys:
            if self._left_to_beside(key) and not self._bound(key):  # its kernels loaded first, in a piece of their own
                pieces.append(lambda key=key: self._bind_beside(key))
            if self._can_warm_beside(key):  # then captured in the next piece (the warm-up may cover the keys after)
                pieces.append((key, True))  # the plans an earlier run's warm-up made, one call a piece
                pieces.append(lambda key=key: self._warm_beside(key))
            if pieces or self._can_capture_beside(key):  # after a warm-up piece: its capture looks when it runs
                pieces.append((key, False))  # its libraries' plans at its rows first, one call a piece
                pieces.append(lambda key=key: self._capture_beside(key))
        return self._with_plans(pieces) if pieces else None

    def _with_plans(self, pieces: list) -> Iterator[Callable[[], object]]:
        """`ahead`'s pieces, each (ShapeKey, warm-up) among them replaced, when the iteration reaches it (after the
        pieces before it ran: its warm-up's record), by the pieces that make that graph's library plans at its rows,
        or at its warm-up's (`_plan_pieces`)."""
        for piece in pieces:
            if isinstance(piece, tuple):
                yield from self._plan_pieces(*piece)
            else:
                yield piece

    def _plan_pieces(self, key: ShapeKey, warm: bool = False) -> list[Callable[[], object]]:
        """The library calls a warm-up of `key`'s kernels made (engine/kernels/plans.py: this process's, else the one
        an earlier run kept), at `key`'s rows, one piece each, where this process has not made them and the graph is
        still to be captured beside the loop: the libraries' setup at new rows (cuDNN's plans: 0.32-0.40 s of a first
        call's host time, benchmarks/probes/plan_prewarm.py) in pieces of at most about 80 ms instead of inside the
        capture's one piece. `warm`: at its warm-up's rows, where it is still to be warmed up beside the loop
        (`_warm_beside`; a new size's first step, whose setup is otherwise that piece's)."""
        if not (self._can_warm_beside(key) if warm else self._can_capture_beside(key)):
            return []
        at = self._warm_key(key) if warm else key
        return [lambda call=call: self._make_plan(key, call) for call in self.plans.to_make(*self._plan_id(at))]

    def _make_plan(self, key: ShapeKey, call) -> None:
        """One of `_plan_pieces`: the call made, counted in `key`'s `planned`."""
        make(call)
        if key not in self.stats:
            self.stats[key] = GraphStats(key)
        self.stats[key].planned += 1

    @staticmethod
    def _plan_id(key: ShapeKey) -> tuple[Warmed, int]:
        """What a graph's library calls are recorded under (`Plans`): what its step runs, rows aside; and its rows."""
        ran = Warmed.of(key)
        return replace(ran, rows=0), ran.rows

    def _kernels_to_come(self, shape: Shape) -> bool:
        """Whether compiled kernels this run wants for `shape`'s size are not in the cache yet (they build)."""
        return self.compiled is not None and any(t in self.compiled.waiting for t in self.compiled.targets([shape]))

    def _left_to_beside(self, key: ShapeKey) -> bool:
        """What a graph's capture beside another batch's loop needs, warmed up or not: it is not captured and has not
        fallen back, it needs no bigger buffer, it writes no DeepCache feature, its kernels are loaded, and the device
        captures beside (`beside_ready`)."""
        stats = self.stats.get(key)
        return (self.beside_ready() and key not in self.graphs and not key.step.cache and self._bound(key, spare=True)
                and (stats is None or stats.state in ("pending", "released")) and self.buf.fits(key.shape))

    def _covered(self, key: ShapeKey) -> bool:
        """Whether a warm-up or capture before ran every kernel of `key`'s graph (it needs no warm-up)."""
        return any(w.covers(Warmed.of(key)) for w in self.warmed)

    def _can_capture_beside(self, key: ShapeKey) -> bool:
        """Whether `key`'s graph can be captured while another batch's loop runs: `_left_to_beside`, and it needs no
        warm-up (a warm-up on the static buffers would break the loop that reads them: `_warm_beside` runs
        elsewhere)."""
        return self._left_to_beside(key) and self._covered(key)

    def _can_warm_beside(self, key: ShapeKey) -> bool:
        """Whether `key`'s graph needs a warm-up that can run while another batch's loop runs (`_warm_beside`): a
        compiled graph with one ControlNet at most, whose artifact's fewest rows run every kernel of it
        (`Warmed.covers`), and `_left_to_beside`. A plain graph's kernels are chosen per shape: its warm-up would be a
        step at its batch's rows."""
        return key.variant != PLAIN and not key.control & ~1 and self._left_to_beside(key) and not self._covered(key)

    def _bound(self, key: ShapeKey, spare: bool = False) -> bool:
        """Whether `key`'s kernels are loaded (a plain graph's are the modules'); `spare`: or in the cache, to be loaded
        before its capture (`_bind`)."""
        return key.variant == PLAIN or key.variant in self.compiled.loaded(key.height, key.width, bool(key.control & 1),
                                                                           spare)

    def _bind_beside(self, key: ShapeKey) -> bool:
        """`key`'s kernels loaded while the replays queued before still run (`ahead`), before its warm-up and capture
        there: the host's work of opening the artifacts and binding the model's tensors (no copy), hidden behind the
        loop. Returns whether it loaded them; one that does not load sends the graph past its row (`_bind`)."""
        return self._left_to_beside(key) and not self._bound(key) and self._bind(key)

    def _beside_ready(self) -> bool:
        return self.models.device.type == "cuda"  # the pool and the capture stream: made by the first (`_record_beside`)

    def _warm_beside(self, key: ShapeKey) -> bool:
        """`key`'s warm-up while the replays queued before still run (`ahead`): a step at its artifact's fewest rows on
        scratch buffers of its own (`beside_warmer`), with no sync; the loop in flight reads the static buffers and
        their step counter, which it leaves alone. What it costs is mostly the host's setup of new shapes (cuDNN's
        plans: a first call at new rows 0.4-0.95 s against 0.06-0.21 s for the next, docs/PERFORMANCE.md, eighteenth
        session), there beside the replays. A failure is logged and leaves the graph to its first use. Returns whether
        it warmed up."""
        if not self._can_warm_beside(key) or not self._bound(key):  # its kernels: loaded by the piece before
            return False
        small = self._warm_key(key)
        t0 = time.perf_counter()
        try:
            self.beside_warmer(small)
        except Exception as e:  # noqa: BLE001 - out of memory included: the loop in flight is not this graph's
            log.warning("warming %s up beside the loop before failed (%s): captured on first use", key.label,
                        one_line(e, 200))
            return False
        stats = self.stats.setdefault(key, GraphStats(key))
        stats.warmup, stats.warmup_rows, stats.warmup_s = True, Warmed.of(small).rows, time.perf_counter() - t0
        self.warmed.append(Warmed.of(small))
        self._warmed_beside.add(key)
        return True

    def _warm_on_scratch(self, small: ShapeKey) -> None:
        """`_warm_beside`'s step: on buffers made for it, on the warm-ups' stream (their blocks stay that stream's in
        the allocator, so freeing them with the step queued is safe), never the static buffers or their counter. That
        stream waits for the work queued so far (no host wait): the weights its kernels read may have been made by the
        piece before (`_bind_beside`: a first load's channels_last and FP8 copies, queued behind the loop)."""
        cuda = self.models.device.type == "cuda"
        if cuda and self.side is None:
            self.side = torch.cuda.Stream()
        if cuda:
            self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side) if cuda else nullcontext():
            scratch = Buffers(self.models, small.batch, small.height * small.width)
            with self.plans.recording(*self._plan_id(small)):
                self.stepper(scratch.view(small))

    def _capture_beside(self, key: ShapeKey) -> bool:
        """Captures `key`'s graph while the replays queued before still run (`ahead`): on torch's capture stream, into
        the shared pool, in thread-local mode (the decode thread's calls stay legal), with none of a capture's usual
        syncs. A failure is logged and leaves the graph to its first use, where the usual capture (and its fallbacks)
        runs. Returns whether it captured."""
        if not self._can_capture_beside(key) or not self._bound(key):  # its kernels: loaded by a piece before
            return False
        stats = self.stats.setdefault(key, GraphStats(key))
        cuda = self.models.device.type == "cuda"
        reserved = torch.cuda.memory_reserved() if cuda else 0
        t0 = time.perf_counter()
        try:
            graph = self.beside_recorder(self.buf.view(key))
        except Exception as e:  # noqa: BLE001 - out of memory included: the loop in flight is not this graph's
            log.warning("capturing %s beside the loop of %s failed (%s): captured on first use", key.label,
                        self._looping or "the batch before", one_line(e, 200))
            return False
        if key not in self._warmed_beside:  # else its warm-up beside counts in (`_warm_beside`)
            stats.warmup, stats.warmup_rows, stats.warmup_s = False, 0, 0.0
        self._warmed_beside.discard(key)
        stats.beside, stats.beside_of, stats.end_s = True, self._looping, self._spent[1]
        stats.capture_s = stats.warmup_s + time.perf_counter() - t0
        # grown by: nothing was emptied first
        stats.pool_mb = (torch.cuda.memory_reserved() - reserved) / 2**20 if cuda else 0.0
        self.warmed.append(Warmed.of(key))
        self.plans.made(*self._plan_id(key))
        self.graphs[key] = graph
        self._adopt(key)
        return True

    def _record_beside(self, v: Views) -> torch.cuda.CUDAGraph:
        """`_capture_beside`'s capture (and `_behind`'s): raises after putting the pool and the CUDA generator right
        again. The first capture of the runner makes the pool, and torch's capture stream where no capture of the
        process made it (torch.cuda.graph makes it so at its first use; every capture records on it, so the library
        handles' workspaces, kept per stream, are made once)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if torch.cuda.graph.default_capture_stream is None:
            torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
        try:
            with torch.cuda.stream(torch.cuda.graph.default_capture_stream):
                graph.capture_begin(self.pool, capture_error_mode="thread_local")
                try:
                    self.stepper(v)
                finally:
                    body = time.perf_counter()
                    graph.capture_end()
                    self._spent = (0.0, time.perf_counter() - body)
        except BaseException:
            graph = None  # now: the traceback keeps this frame
            self._after_failed_capture(stream)
            raise
        return graph

    @staticmethod
    def _capture_order(key: ShapeKey) -> tuple:
        ran = Warmed.of(key)
        return ran.rows * key.height * key.width, ran.control, ran.whole, key.step.guided

    def release(self, reason: str = "freed after an out-of-memory") -> None:
        """Frees every graph and the shared pool; shapes are captured (and checked) again on use."""
        for key in self.graphs:
            stats = self.stats[key]
            stats.state, stats.reason, stats.checked = "released", reason, False
        self.graphs.clear()
        self._warmed_beside.clear()
        self.pool = None
        self.buf.feature = None  # DeepCache's: no graph points at it any more
        gc.collect()
        self._settle()

    # ------------------------------------------------------------------ running

    def _check(self, key: ShapeKey, graph: torch.cuda.CUDAGraph, *inputs) -> bool:
        """The first replay against a reference step (graph/check.py); a failure falls back with the reason. The
        reference is the eager step, the first time a variant's kernels run at a size, ControlNets and step kind in this
        runner (or on these weights and this machine, with a ledger). At other rows the same kernels (a compiled
        artifact's rows are its one dynamic dimension) were checked against it already, and the reference is the
        graph's own step outside the graph: it checks what the capture can break (the static buffers, the pool, the
        launch order) at the cost of one step on those kernels, where the eager step costs a host-bound pass through the
        modules and their per-shape setup (0.2-0.9 s per shape on an H200, docs/PERFORMANCE.md)."""
        seen = self._checked_kernels(key)
        direct = None if seen is None else self.step
        err, problem = first_replay(self.models, self.buf, key, graph.replay, *inputs, direct=direct)
        against = "" if seen is None else f" against its kernels outside the graph (against eager {seen})"
        if problem:
            self._fall_back(key, f"replay check failed: {problem}{against}")
            return False
        self.stats[key].checked, self.stats[key].reason = True, f"checked: rel. error {err:.1e}{against}"
        if seen is None:
            self.against_eager.append((key, self.models.writes))
            if self.ledger is not None:
                self.ledger.record(key, err)
        return True

    def _checked_kernels(self, key: ShapeKey) -> str | None:
        """Where a graph of `key`'s compiled kernels (its variant, size, ControlNets and step kind) had its first
        replay match the eager step, on the weights as they are (no in-place write since, such as a LoRA swap:
        SdxlModels.written): "at N images" in this runner, at other rows, or "at N images in an earlier run" (the
        ledger's). None for the plain graphs (their kernels are the modules' own, chosen per shape) and when there is
        none."""
        if key.variant == PLAIN:
            return None
        writes = self.models.writes
        here = next((k for k, w in self.against_eager if w == writes and replace(k, batch=key.batch) == key), None)
        if here is not None:
            return f"at {here.batch} images"
        earlier = None if self.ledger is None else self.ledger.seen(key)
        return None if earlier is None else f"at {earlier} images in an earlier run"

    def _checked_graph(self, key: ShapeKey, *inputs, first: bool = False) -> torch.cuda.CUDAGraph | None:
        """The graph for `key`, captured and checked; None when the shape has fallen back (why: stats). `first`: the
        graph runs the batch's first step, so a check against its kernels outside the graph is left to that step
        (`_first_step`)."""
        graph = self.graph(key)
        if graph is None or self.stats[key].checked or (first and self._first_step_checks(key)):
            return graph
        return graph if self._check(key, graph, *inputs) else None

    def _first_step_checks(self, key: ShapeKey) -> bool:
        """Whether `key`'s graph is checked on its batch's first step: its kernels were checked against the eager step
        at other rows, and the step writes no DeepCache feature (whose check reads the buffer's copy before it)."""
        return not key.step.cache and self._checked_kernels(key) is not None

    def _first_step(self, key: ShapeKey, graph: torch.cuda.CUDAGraph, v: Views, x: torch.Tensor, sched: Schedule,
                    noise: torch.Tensor | None, cond: Cond, conds: Conditions, guidance: torch.Tensor, i: int = 0,
                    prev: torch.Tensor | None = None, note: str = "") -> bool:
        """The batch's first step on `key`'s graph, checked against the graph's step outside it (the buffers loaded with
        the batch): for the batch's first image alone where the graph has more and is guided (graph/check.py
        `first_step_of_part` at 1 image: a step of one image, not of the batch), else for the batch (`first_step`).
        The graph's first replay may be a later step `i` (`_behind`, which checks on the first image alone): `x` and
        `prev` are then the latents and prediction the steps before left; `note` ends the reason. True and the buffers
        after that step, or the shape falls back a row with the reason."""
        seen = self._checked_kernels(key)
        first = None if noise is None else noise[i]
        # the check runs the first image alone (check.py first_step_of_part) where the row's rounding allows
        one = key.batch > 1 and key.step.guided and VARIANTS[key.variant].alone_rtol is not None
        if one:
            err, problem = first_step_of_part(v, graph.replay, lambda: self.part_step(v, x, first, 1, i, prev), first,
                                              1)
        else:
            err, problem = first_step(self.buf, v, graph.replay, self.step, x, sched, first, cond, conds, guidance)
        against = f" against its kernels outside the graph{' at 1 image' if one else ''} (against eager {seen})"
        if problem:
            self._fall_back(key, f"replay check failed: {problem}{against}")
            return False
        stats = self.stats[key]
        stats.checked, stats.reason = True, f"checked: rel. error {err:.1e}{against}{note}"
        stats.replays += 1
        return True

    @torch.no_grad()
    def sample(self, x: torch.Tensor, sched: Schedule, noise: torch.Tensor | None, cond: Cond,
               conds: Conditions | None, guidance: torch.Tensor, plan: StepPlan | None = None,
               between: Iterator[Callable[[], object]] | None = None) -> torch.Tensor:
        """Same contract as EagerEngine.sample: initial latents [B, 4, h, w] -> final latents. Every graph the
        plan needs is captured and checked before the loop (the DeepCache full step before its shallow one), so no
        capture runs between `between`'s pieces."""
        if self.compiled is not None:
            self.compiled.poll()  # between batches: kernels finished in the background since the last one
        entry = self._event()  # what runs before the loop counts from here (GraphStats.leads)
        b, _, h, w = x.shape
        conds = conds or Conditions()
        shape = Shape(b, 8 * h, 8 * w, conds.bits)
        plan = plan or (FULL,) * sched.steps
        self._share(shape, set(plan))
        own = self.shape_key(*shape, plan[0])
        if len(set(plan)) == 1 and len(plan) > OWN_STEPS + 1 and self._can_capture_behind(own):
            start = self._behind(own, x, sched, noise, cond, conds, guidance)
            if start is None:  # it fell back, or its capture failed: the batch again from its start, captured before
                return self.sample(x, sched, noise, cond, conds, guidance, plan, between)
            steps, v = [(own, self.graphs[own])] * len(plan), self.buf.view(own)
            return self._loop(steps, start, v, noise, entry, between)
        graphs = self._plan_graphs(shape, set(plan), (x, sched, cond, conds, guidance), len(set(plan)) == 1)
        if graphs is None:
            return self.eager.sample(x, sched, noise, cond, conds, guidance, plan, between)
        steps = [graphs[kind] for kind in plan]  # (key, graph) of each step
        v = self.buf.view(steps[0][0])  # every kind of the shape views the same buffers
        v.load(self.buf, x, sched, cond, conds, guidance)
        start = 0
        if not self.stats[steps[0][0]].checked:  # left to the batch's first step (`_checked_graph`)
            if not self._first_step(*steps[0], v, x, sched, noise, cond, conds, guidance):
                del steps, graphs, v  # the failed graph: freed before the shape's next row is captured
                self._settle()
                return self.sample(x, sched, noise, cond, conds, guidance, plan, between)  # a row down
            start = 1
        return self._loop(steps, start, v, noise, entry, between)

    def _loop(self, steps: list[tuple[ShapeKey, torch.cuda.CUDAGraph]], start: int, v: Views,
              noise: torch.Tensor | None, entry: torch.cuda.Event | None,
              between: Iterator[Callable[[], object]] | None) -> torch.Tensor:
        """`sample`'s loop: the replays of `steps` from step `start` on (the steps before it ran already), `between`'s
        pieces between them; the final latents."""
        segment = None  # (key, start event, first step): consecutive steps of one kind, timed together
        pace = self.pace(self.models.device.type == "cuda")
        self._looping = steps[0][0].label
        for i, (key, graph) in enumerate(steps[start:], start):
            if segment is None or segment[0] != key:
                first = segment is None
                self._time(segment, i)
                segment = (key, self._event(), i)
                if first and entry is not None:  # the batch's lead: its entry to its loop's first replay
                    self.stats[steps[0][0]].leads.append((entry, segment[1]))
            pace.replay(graph, None if noise is None else lambda i=i: v.noise.copy_(noise[i]))
            between = pace.run(between)  # while the GPU runs the replays queued so far
        run_between(between, everything=True)
        self._looping = ""
        self._time(segment, len(steps))
        self.stats[steps[0][0]].gaps += pace.gaps
        return v.x.clone()  # clone: the next batch overwrites the static buffer

    def _can_capture_behind(self, key: ShapeKey) -> bool:
        """Whether `key`'s graph can be captured beside its own batch's first steps (`_behind`): it is not captured, has
        not fallen back and has not failed so, its kernels were checked against the eager step at other rows (a
        compiled graph: its first replay is checked against its kernels outside the graph, `_first_step_checks`), it is
        checked on its first image alone (a guided batch of more than one image, a variant with `alone_rtol`), and it
        fits the buffers; on a device where captures beside run (`beside_ready`)."""
        stats = self.stats.get(key)
        return (self.beside_ready() and key not in self.graphs and key not in self._not_behind
                and (stats is None or stats.state in ("pending", "released")) and key.batch > 1 and key.step.guided
                and VARIANTS[key.variant].alone_rtol is not None and self._first_step_checks(key)
                and self.buf.fits(key.shape))

    def _behind(self, key: ShapeKey, x: torch.Tensor, sched: Schedule, noise: torch.Tensor | None, cond: Cond,
                conds: Conditions, guidance: torch.Tensor) -> int | None:
        """The batch's first `OWN_STEPS` steps on `key`'s kernels outside the graph, on its static buffers, then its
        graph captured beside them (`_capture_beside`: no sync, the capture stream) while the GPU runs them, then its
        first replay (the next step) checked against that step for the first image alone (check.py
        `first_step_of_part`). The first step is the graph's warm-up at its own rows: where a capture ahead warms up at
        the artifact's fewest rows and then meets the libraries' setup at the batch's rows again in the capture, with
        the GPU idle throughout (1.05-1.16 s before the bench job's first loop, docs/PERFORMANCE.md), here that setup
        is paid once, while the GPU runs the kernels launched so far, and the capture's host time is behind the steps.
        Returns the step the loop goes on from; None where a step outside the graph failed or the check did (the shape
        has fallen back a row) or the capture failed (logged; the graph is captured before its loop then): the batch
        runs again from its start."""
        if not self._bind(key):  # fell back a row (`_bind`)
            return None
        stats = self.stats.setdefault(key, GraphStats(key))
        v = self.buf.view(key)
        v.load(self.buf, x, sched, cond, conds, guidance)
        t0 = time.perf_counter()
        try:
            for i in range(OWN_STEPS):
                if noise is not None:
                    v.noise.copy_(noise[i])
                with self.plans.recording(*self._plan_id(key)) if i == 0 else nullcontext():
                    self.stepper(v)
        except torch.cuda.OutOfMemoryError:
            raise  # not this shape's fault: the caller splits the batch, as at a capture (`graph`)
        except Exception as e:  # noqa: BLE001 - a kernel that fails outside the graph fails inside it too
            self._settle()
            self._fall_back(key, f"its first steps outside the graph failed: {one_line(e, 200)}")
            return None
        # the steps ran every kernel of the graph: its warm-up, counted in its capture beside them (`_capture_beside`,
        # whose loop is the batch's own; out of memory included, a failure leaves it to a capture before its loop)
        stats.warmup, stats.warmup_rows, stats.warmup_s = True, Warmed.of(key).rows, time.perf_counter() - t0
        self.warmed.append(Warmed.of(key))
        self._warmed_beside.add(key)
        self._looping = key.label
        captured = self._capture_beside(key)
        self._looping = ""
        if not captured:
            self._warmed_beside.discard(key)
            self._not_behind.add(key)
            self._settle()
            return None
        # the first replay, step OWN_STEPS, against the first image's step alone (`_can_capture_behind`) from the
        # latents and prediction the steps outside the graph left
        note = f"; captured beside its batch's first {OWN_STEPS} steps"
        if not self._first_step(key, self.graphs[key], v, v.x[:1].clone(), sched, noise, cond, conds, guidance,
                                OWN_STEPS, v.prev[:1].clone(), note):
            self._settle()
            return None
        return OWN_STEPS + 1

    def _plan_graphs(self, shape: Shape, kinds: set[StepKind], inputs: tuple, first: bool = False) -> dict | None:
        """kind -> (key, graph) for each of `kinds`, captured and checked (DeepCache's full step before its shallow
        one) on the best variant left to it; None when a plain graph failed: the shape runs eager. The one fallback
        loop: a graph that fails moves its shape one row down the variant table (`_fall_back`) and every kind is keyed
        again, so each pass runs one row lower, and the plain row's failure ends it. `first`: one kind, whose graph
        runs the batch's first step (its check may be left to that step)."""
        while True:
            key_of = {kind: self.shape_key(*shape, kind) for kind in kinds}
            failed = next((key for key in sorted(set(key_of.values()), key=lambda k: (k.step.cache != "write", k.step))
                           if self._checked_graph(key, *inputs, first=first) is None), None)
            if failed is None:
                return {kind: (key, self.graphs[key]) for kind, key in key_of.items()}
            if VARIANTS[failed.variant].fallback == EAGER:
                return None

    def _event(self) -> torch.cuda.Event | None:
        if self.models.device.type != "cuda":  # a test's replays on the CPU (GraphRunner.capturer)
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _time(self, segment: tuple | None, stop: int) -> None:
        """Closes a segment of replays of one graph: its steps and CUDA events go to that graph's stats."""
        if segment is not None:
            key, start, first = segment
            stats = self.stats[key]
            stats.replays += stop - first
            if start is not None:
                stats.events.append((start, self._event(), stop - first))

    def describe(self) -> list[dict]:
        return [{"shape": s.key.label, "state": s.state, "variant": s.ran, "reason": s.reason,
                 "capture_s": round(s.capture_s, 3), "warmup": s.warmup, "warmup_rows": s.warmup_rows,
                 "warmup_s": round(s.warmup_s, 3), "end_s": round(s.end_s, 3), "beside": s.beside,
                 "beside_of": s.beside_of, "compile_s": round(s.compile_s, 3), "pool_mb": round(s.pool_mb, 1),
                 "planned": s.planned, "replays": s.replays, "replay_ms": round(s.replay_ms, 3),
                 "idle_ms": round(s.idle_ms, 3), "batches": len(s.leads), "lead_ms": round(s.lead_ms, 3),
                 "load_s": round(s.load_s, 3)}
                for s in sorted(self.stats.values(), key=lambda s: s.key, reverse=True)]

"""What each step of a denoising loop runs: the draft levers (guidance cut-off, DeepCache) and the ControlNet's
end, as one plan of step kinds fixed before the loop. No torch: the plan (`bcg plan`'s savings) and the engines
(which pick each step's graph from it) read the same rules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class StepKind:
    """What one step runs. `guided`: the CFG-doubled rows [2B], or the conditional rows [B] alone (after the
    guidance cut-off, or for images with guidance <= 1). `cache`: "" the UNet as today, "write" the UNet writing
    DeepCache's feature at `branch`, "read" DeepCache's shallow path on it. `control`: False once a batch's
    ControlNet has ended (its `control.end`); True in a batch without one."""

    guided: bool = True
    cache: str = ""
    branch: int = 0
    control: bool = True

    @property
    def label(self) -> str:
        """"" for today's step; else e.g. "cond", "deepcache full b0", "cond no-control deepcache shallow b0"."""
        parts = [] if self.guided else ["cond"]
        if not self.control:
            parts.append("no-control")
        if self.cache:
            parts.append(f"deepcache {'full' if self.cache == 'write' else 'shallow'} b{self.branch}")
        return " ".join(parts)


FULL = StepKind()
StepPlan = tuple[StepKind, ...]  # one kind per step, fixed before the loop: the host picks each step's graph


@dataclass(frozen=True, order=True)
class DeepCache:
    """DeepCache's schedule (a shot's `deepcache:`): the whole UNet every `interval`-th step, writing the feature
    that enters up block `branch`, and its shallow path on that feature between. Interval 0: off, and falsy."""

    interval: int = 0
    branch: int = 0

    def __bool__(self) -> bool:
        return self.interval > 0

    @property
    def label(self) -> str:
        """"deepcache 3/b0" ("" when off): how `bcg plan`, a bucket's label and the contact sheet name it."""
        return f"deepcache {self.interval}/b{self.branch}" if self else ""

    def to_json(self) -> dict[str, int] | None:
        """{"interval": 3, "branch": 0}, None when off: in a PNG's settings, the report and `bcg plan --json`."""
        return {"interval": self.interval, "branch": self.branch} if self else None

    @classmethod
    def from_json(cls, value: object) -> DeepCache:
        """The form `to_json` writes, read back (a PNG's settings); anything else is off."""
        if not isinstance(value, dict):
            return cls()
        interval, branch = value.get("interval"), value.get("branch", 0)
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (interval, branch))
        return cls(interval, branch) if ints else cls()


NO_DEEPCACHE = DeepCache()

# a DeepCache shallow step's FLOPs against the full UNet's, per branch: SDXL-base at 1024x1024, counted with
# torch.utils.flop_counter on the meta device (tests/test_draft.py counts them again). Time is not FLOPs:
# the shallow path is the UNet's most memory-bound part (bench part `draft` measures the time)
SHALLOW_FLOPS = (0.067, 0.307, 0.882)
# SDXL's ControlNet (a copy of the UNet's encoder and mid block) against one UNet step at the same rows, counted
# the same way
CONTROLNET_FLOPS = 0.447


def guided_steps(steps: int, cfg_cutoff: float) -> int:
    """The steps that use guidance for a cut-off fraction, as diffusers' SDXLCFGCutoffCallback counts them: the
    unconditional rows go at the end of step int(steps * ratio), so that step and the ones before are guided
    (1.0: every step)."""
    return min(steps, int(steps * cfg_cutoff) + 1)


def control_steps(steps: int, end: float) -> int:
    """The steps a ControlNet runs for its `end` fraction, as diffusers' `control_guidance_end` keeps them: step
    i while (i + 1) / steps <= end (1.0: every step). The tolerance keeps end = k / steps at k steps."""
    return min(steps, int(steps * end + 1e-9))


def step_plan(steps: int, guided: int, interval: int = 0, branch: int = 0, control: int | None = None) -> StepPlan:
    """The kind of every step: the first `guided` steps use guidance. `control`: None for a batch without a
    ControlNet; else the steps it runs (the first ones). DeepCache (interval >= 2) runs the full UNet and writes
    the feature on its first step and every `interval`-th after, and reads it between (DeepCache's uniform
    schedule); with a ControlNet it starts once the ControlNet has ended (its residuals feed the blocks a
    shallow step skips), so a ControlNet that runs to the end leaves no DeepCache step."""
    start = 0 if control is None else control
    kinds = []
    for i in range(steps):
        cache = "" if interval < 2 or i < start else ("write" if (i - start) % interval == 0 else "read")
        kinds.append(StepKind(i < guided, cache, branch if cache else 0, control is None or i < control))
    return tuple(kinds)


def levers_label(steps: int, guided: bool, cfg_cutoff: float = 1.0, control: bool = False, control_end: float = 1.0,
                 deepcache: DeepCache = NO_DEEPCACHE) -> str:
    """What a loop does differently from a full render, in the words of `bcg plan`, a bucket's label and the
    contact sheet ("" when nothing): e.g. "cfg_cutoff 0.5 (16/30 guided), control end 0.5 (15/30 steps),
    deepcache 3/b0"; "no CFG" where no step is guided (`guided`: guidance > 1)."""
    parts = []
    guided_n = guided_steps(steps, cfg_cutoff) if guided else 0
    if not guided_n:
        parts.append("no CFG")
    elif guided_n < steps:
        parts.append(f"cfg_cutoff {cfg_cutoff:g} ({guided_n}/{steps} guided)")
    if control and (control_n := control_steps(steps, control_end)) < steps:
        parts.append(f"control end {control_end:.3g} ({control_n}/{steps} steps)")
    if deepcache:
        parts.append(deepcache.label)
    return ", ".join(parts)


def plan_label(plan: StepPlan) -> str:
    """A plan in a few words: e.g. "16/30 guided, deepcache 10 full + 20 shallow b0, ControlNet 16/30"."""
    n = len(plan)
    parts = [f"{sum(k.guided for k in plan)}/{n} guided"]
    writes, reads = sum(k.cache == "write" for k in plan), sum(k.cache == "read" for k in plan)
    if writes or reads:
        parts.append(f"deepcache {writes} full + {reads} shallow b{next(k.branch for k in plan if k.cache)}")
    if not all(k.control for k in plan):
        parts.append(f"ControlNet {sum(k.control for k in plan)}/{n}")
    return ", ".join(parts)


def step_costs(plan: StepPlan, with_control: int = 0) -> float:
    """A loop's FLOPs in full guided steps of its own kind (UNet, and the ControlNets where the batch has them:
    `with_control` of them): a conditional step is half (half the rows), a shallow step SHALLOW_FLOPS[branch] of a full
    UNet, a step whose ControlNets have ended saves their share. The estimate `bcg plan` shows."""
    whole = 1.0 + CONTROLNET_FLOPS * int(with_control)
    total = 0.0
    for kind in plan:
        unet = SHALLOW_FLOPS[kind.branch] if kind.cache == "read" else 1.0
        controlnet = CONTROLNET_FLOPS * int(with_control) if kind.control else 0.0
        total += (1.0 if kind.guided else 0.5) * (unet + controlnet) / whole
    return total

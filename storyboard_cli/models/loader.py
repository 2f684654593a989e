"""load_sdxl(spec) -> SdxlModels, from "tiny", "sdxl-random", a diffusers folder, a single
.safetensors file (with SDXL configs shipped in the package), or a hub id."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from storyboard_cli.errors import ModelError, one_line
from storyboard_cli.models.groupnorm import fuse, widen
from storyboard_cli.models.tiny import cache_root, tiny_folder
from storyboard_cli.models.vae_attention import attend

log = logging.getLogger(__name__)
SDXL_CONFIGS = Path(__file__).parent / "configs" / "sdxl-base"


@dataclass
class SdxlModels:
    name: str
    tokenizers: tuple[Any, Any]
    text_encoders: tuple[Any, Any]  # CLIPTextModel, CLIPTextModelWithProjection
    unet: Any
    vae: Any
    scheduler_config: dict
    device: torch.device
    dtype: torch.dtype  # UNet / ControlNet / text encoders
    controlnets: tuple[Any, ...] = ()  # every ControlNet, in the job's order of nets
    ip_adapter: Any | None = None  # models/ip_adapter.py IpAdapter: its processors are in the UNet
    region_layout: Any | None = None  # models/regions.py Layout: the UNet's attention takes regional prompts
    # tensors derived from weights that other kernels read (the compiled convolutions' channels_last copies, FP8
    # weights and their scales): name -> (value, refresh), and id(parameter) -> the names derived from it;
    # `written` refreshes them in place (compiled kernels hold their pointers)
    derived: dict[str, tuple[Any, Callable[[Any], None]]] = field(default_factory=dict, repr=False)
    sources: dict[int, list[str]] = field(default_factory=dict, repr=False)
    # calls of `written` so far: a graph's check against the eager step holds for the weights it saw (GraphRunner)
    writes: int = field(default=0, repr=False)

    def derive(self, name: str, params: list[Any], make: Callable[[], Any], refresh: Callable[[Any], None]) -> Any:
        """The registered value `name` (made by `make` the first time), refreshed by `refresh(value)` after an in-place
        write to any of `params`."""
        if name not in self.derived:
            self.derived[name] = (make(), refresh)
            for p in params:
                self.sources.setdefault(id(p), []).append(name)
        return self.derived[name][0]

    def copy_of(self, param: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The registered copy of `param` in another layout (made by `make` the first time)."""
        return self.derive(f"copy:{id(param)}", [param], lambda: make(param.detach()),
                           lambda copy: copy.copy_(param.detach()))

    def written(self, *params: Any) -> None:
        """After in-place writes to `params` (a LoRA swap): what is derived from them follows, in place (the pointers
        compiled kernels hold do not change), each once however many of its sources were written (an FP8 copy of
        the fused q/k/v weight after writes to to_q, to_k and to_v)."""
        self.writes += 1
        for name in dict.fromkeys(n for p in params for n in self.sources.get(id(p), ())):
            value, refresh = self.derived[name]
            refresh(value)

    @property
    def vae_dtype(self) -> torch.dtype:
        # SDXL's VAE overflows in fp16: decode in fp32 where its config says so (as diffusers' upcast_vae)
        if self.dtype == torch.float16 and getattr(self.vae.config, "force_upcast", False):
            return torch.float32
        return self.dtype


def sdxl_config_folder() -> Path:
    """SDXL-base configs plus real CLIP tokenizers, as a diffusers folder (for single files)."""
    folder = cache_root() / "sdxl-base-config-v1"
    if (folder / "tokenizer_2" / "tokenizer_config.json").is_file():
        return folder
    from storyboard_cli.models.tokenizers import make_tokenizer, real_clip_merges

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".cfg-", dir=folder.parent))
    shutil.copytree(SDXL_CONFIGS, tmp, dirs_exist_ok=True)
    merges = real_clip_merges()
    make_tokenizer(merges).save_pretrained(tmp / "tokenizer")
    make_tokenizer(merges, pad_token="!").save_pretrained(tmp / "tokenizer_2")
    try:
        tmp.rename(folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _is_pathlike(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.endswith((".safetensors", ".ckpt")) or Path(spec).exists()


def _from_folder(source: str, device: torch.device, dtype: torch.dtype, **hub: Any) -> dict:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    vae_dtype = dtype
    parts = {
        "tokenizers": (CLIPTokenizer.from_pretrained(source, subfolder="tokenizer", **hub),
                       CLIPTokenizer.from_pretrained(source, subfolder="tokenizer_2", **hub)),
        "text_encoders": (CLIPTextModel.from_pretrained(source, subfolder="text_encoder", dtype=dtype, **hub),
                          CLIPTextModelWithProjection.from_pretrained(source, subfolder="text_encoder_2",
                                                                      dtype=dtype, **hub)),
        "unet": UNet2DConditionModel.from_pretrained(source, subfolder="unet", torch_dtype=dtype, **hub),
        "vae": AutoencoderKL.from_pretrained(source, subfolder="vae", torch_dtype=vae_dtype, **hub),
    }
    from diffusers import EulerDiscreteScheduler

    parts["scheduler_config"] = dict(EulerDiscreteScheduler.load_config(source, subfolder="scheduler", **hub))
    return parts


def _from_single_file(path: Path, dtype: torch.dtype) -> dict:
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_single_file(str(path), config=str(sdxl_config_folder()),
                                                      local_files_only=True, torch_dtype=dtype)
    return {"tokenizers": (pipe.tokenizer, pipe.tokenizer_2),
            "text_encoders": (pipe.text_encoder, pipe.text_encoder_2),
            "unet": pipe.unet, "vae": pipe.vae, "scheduler_config": dict(pipe.scheduler.config)}


def _random_sdxl(device: torch.device, dtype: torch.dtype) -> dict:
    """Full SDXL-base architecture, random weights, built straight on the device (kernel timing only)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    folder = sdxl_config_folder()
    torch.manual_seed(0)
    with torch.device(device):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet")).to(dtype)
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae"))
        te1 = CLIPTextModel(CLIPTextConfig.from_pretrained(folder / "text_encoder")).to(dtype)
        te2 = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(folder / "text_encoder_2")).to(dtype)
    return {"tokenizers": (CLIPTokenizer.from_pretrained(folder / "tokenizer"),
                           CLIPTokenizer.from_pretrained(folder / "tokenizer_2")),
            "text_encoders": (te1, te2), "unet": unet, "vae": vae,
            "scheduler_config": json.loads((folder / "scheduler" / "scheduler_config.json").read_text())}


def _load_controlnet(spec: str, unet: Any, device: torch.device, dtype: torch.dtype) -> Any:
    from diffusers import ControlNetModel

    if spec == "tiny":
        return ControlNetModel.from_pretrained(tiny_folder() / "controlnet", torch_dtype=dtype)
    if spec == "sdxl-random":
        torch.manual_seed(1)
        with torch.device(device):
            return ControlNetModel.from_unet(unet, load_weights_from_unet=False).to(dtype)
    path = Path(spec).expanduser()
    if path.is_file():
        return ControlNetModel.from_single_file(str(path), torch_dtype=dtype)
    if path.is_dir():
        return ControlNetModel.from_pretrained(str(path), torch_dtype=dtype)
    if _is_pathlike(spec):
        raise ModelError(f"controlnet: no such file or folder: {spec}")
    return _from_hub(spec, lambda **hub: ControlNetModel.from_pretrained(spec, torch_dtype=dtype, **hub))


def _load_parts(spec: str, device: torch.device, dtype: torch.dtype) -> dict:
    if spec == "tiny":
        return _from_folder(str(tiny_folder()), device, dtype)
    if spec == "sdxl-random":
        return _random_sdxl(device, dtype)
    path = Path(spec).expanduser()
    if path.is_file():
        return _from_single_file(path, dtype)
    if path.is_dir():
        if not (path / "unet").is_dir():
            raise ModelError(f"model: {spec} is a folder but not a diffusers SDXL folder (no unet/ inside)")
        return _from_folder(str(path), device, dtype)
    if _is_pathlike(spec):
        raise ModelError(f"model: no such file or folder: {spec}")
    return _from_hub(spec, lambda **hub: _from_folder(spec, device, dtype, **hub))


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A fast check, so that an offline machine fails in seconds instead of waiting on retries."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def _from_hub(spec: str, load):
    """A hub id: the local cache first; the hub only if it can be reached."""
    try:
        return load(local_files_only=True)
    except Exception as cached_error:  # noqa: BLE001 - not (fully) in the cache
        if not _hub_reachable():
            raise ModelError(f"model: {spec!r} is not in the local hub cache and the hub cannot be reached "
                             f"(point model: at a folder or a .safetensors file)") from cached_error
    return load()


def _quiet_libraries() -> None:
    """Their load-time advice (accelerate, dtype casts) is noise on a user's terminal."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()


ALLOCATOR = "expandable_segments:True"
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def cuda_allocator() -> str:
    """The CUDA caching allocator's settings for this process, before its first CUDA memory: expandable segments
    (one growing range of device memory per pool instead of a segment per large tensor), unless the user set the
    allocator's environment variable, which then stands as it is. Returns what is in force.

    Why (docs/PERFORMANCE.md, "Draft renders"): the CUDA graphs share one memory pool, and a later graph whose
    tensors come in another order than the first's did not fit the blocks the first left free: 646 MB more at
    8 x 1024x1024 for a second graph of the same size. In expandable segments the pool of today's and draft mode's
    graphs at that size was 3648 MB against 4674 MB, the draft's kinds 2 MB of it."""
    for name in ALLOCATOR_ENV:
        if os.environ.get(name):
            return os.environ[name]
    torch.cuda.memory._set_allocator_settings(ALLOCATOR)
    return ALLOCATOR


def load_sdxl(spec: str, controlnet: str | tuple[str, ...] | None, device: str | torch.device, dtype: torch.dtype,
              ip_adapter: str | None = None, image_encoder: str | None = None, regions: int = 0) -> SdxlModels:
    """Loads every part onto `device`. `controlnet`: one ControlNet, or a job's nets in its order (one module per
    distinct spec: two nets of the same weights share it). `ip_adapter`: its processors go into the UNet
    (models/ip_adapter.py). `regions`: the UNet's attention takes regional prompts in this many region slots
    (models/regions.py; the most regions a shot of the job has, job/conditions/region.py `slots`; 0: none). Raises
    ModelError (with the cause, one line) on failure."""
    device = torch.device(device)
    if device.type == "cuda":
        cuda_allocator()
    _quiet_libraries()
    specs = (controlnet,) if isinstance(controlnet, str) else tuple(controlnet or ())
    try:
        parts = _load_parts(spec, device, dtype)
        loaded: dict[str, Any] = {}
        for net in specs:
            if net not in loaded:
                loaded[net] = _load_controlnet(net, parts["unet"], device, dtype)
    except ModelError:
        raise
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read user-provided weights is reported in one line
        first = one_line(e)
        nets = f" / controlnet {', '.join(map(repr, specs))}" if specs else ""
        raise ModelError(f"cannot load model {spec!r}{nets}: {first}") from e
    nets = tuple(loaded[net] for net in specs)
    models = SdxlModels(spec, parts["tokenizers"], parts["text_encoders"], parts["unet"], parts["vae"],
                        parts["scheduler_config"], device, dtype, controlnets=nets)
    vae_dtype = models.vae_dtype
    for module, dt in ((models.unet, dtype), (models.vae, vae_dtype), (models.text_encoders[0], dtype),
                       (models.text_encoders[1], dtype), *((net, dtype) for net in loaded.values())):
        if module.dtype != dt:
            module.to(dtype=dt)
        module.to(device=device).eval().requires_grad_(False)
    if ip_adapter is not None:
        from storyboard_cli.models.ip_adapter import load_ip_adapter

        models.ip_adapter = load_ip_adapter(ip_adapter, image_encoder, models.unet, device, dtype)
    if regions:
        from storyboard_cli.job.conditions.region import REGION_REFERENCES, REGION_SLOTS  # the job's limits: the slots
        from storyboard_cli.models.regions import install

        if not 0 < regions <= REGION_SLOTS:
            raise ValueError(f"regions={regions}: the region slots are 1 to {REGION_SLOTS}")
        models.region_layout = install(models.unet, int(regions), REGION_REFERENCES)
    if device.type == "cuda":  # one image at a time, torch's GroupNorm kernel uses a quarter of the GPU; its float32
        widen(models.vae.decoder)  # attention runs on the plain float units (models/vae_attention.py)
        fuse(models.vae.decoder)  # the SiLUs inside the norms, channels_last: no layout conversions around cuDNN
        attend(models.vae.decoder)
    return models


def host_decoder(models: SdxlModels) -> SdxlModels:
    """`models` with a float32 copy of its VAE in host memory, the plain diffusers modules (no GPU kernels) and the
    same weights, for a decode on the CPU: the last resort of a decode the GPU has no memory for (run/oom.py). Copied
    weight by weight to the host: nothing of it is allocated on the GPU."""
    vae = models.vae
    host = type(vae).from_config(vae.config)
    host.load_state_dict({k: v.detach().to("cpu", torch.float32) for k, v in vae.state_dict().items()})
    return replace(models, vae=host.eval().requires_grad_(False), device=torch.device("cpu"), dtype=torch.float32)

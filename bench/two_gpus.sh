#!/usr/bin/env bash
# One job on 2 GPUs against 1, same machine, same run: pixels equal, images/s after loading (capture
# included) and the workers table. On a 2-GPU machine, from the repository root:
#   bash bench/two_gpus.sh tiny     # a small tiny-model job: the path and the pixels
#   bash bench/two_gpus.sh bench    # jobs/bench.yaml on sdxl-random: the speed-up (goal >= 1.85x), and
#                                   # whether 1 GPU repeats itself (two 1-GPU renders at once, one per GPU)
set -x
source .whl/prelude.sh || exit 1
export PYTHONPATH=$PWD:/tmp/site BCG_CACHE=/tmp/bcg NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=/tmp/w; mkdir -p $W; cp -r jobs/control $W/ 2>/dev/null
cat > $W/tiny.yaml <<'YAML'
version: 1
model: tiny
controlnet: tiny
buckets: [1, 2, 4]
shots:
  - {id: big, prompt: a lighthouse at night, steps: 8, size: 256x384, candidates: 5, seed: 11}
  - {id: wide, prompt: a boat in the waves, steps: 8, size: 384x256, candidates: 3, seed: 12}
  - {id: small, prompt: a hut, steps: 6, size: 256x256, candidates: 6, seed: 13, sampler: dpmpp_2m}
  - {id: pose, prompt: the keeper, steps: 6, size: 256x256, candidates: 2, seed: 14, control: {image: control/hero_pose.png, scale: 0.8}}
YAML
cp jobs/bench.yaml $W/bench.yaml
cd $W
cmp_dirs() { python3 - "$@" <<'PY'
import sys, numpy as np, json
from pathlib import Path
from PIL import Image
a, b = Path(sys.argv[1]), Path(sys.argv[2])
pa = sorted(p.relative_to(a).as_posix() for p in a.rglob("*.png")); pb = sorted(p.relative_to(b).as_posix() for p in b.rglob("*.png"))
assert pa == pb, (len(pa), len(pb))
diff = {}
for p in pa:
    x, y = (np.asarray(Image.open(d / p), dtype=np.int16) for d in (a, b))
    if not np.array_equal(x, y):
        diff[p] = f"max |diff| {np.abs(x - y).max()}, {int((x != y).any(-1).sum())} pixels"
print(a.name, "vs", b.name, "images", len(pa), "pixel-different", len(diff), diff)
if len(sys.argv) > 3: sys.exit()
ra, rb = json.loads((a / "report.json").read_text()), json.loads((b / "report.json").read_text())
single = ra["images_rendered"] / (ra["wall_s"] - ra["stages_s"]["load"])
print("1 GPU: wall", ra["wall_s"], "load", ra["stages_s"]["load"], "capture", ra["stages_s"]["capture"], "img/s excl. load", round(single, 4))
print("2 GPU: wall", rb["wall_s"], "render_s", rb["render_s"], "img/s excl. load", rb["render_images_per_s"], "ratio", round(rb["render_images_per_s"] / single, 3))
for w in rb["workers"]: print("  worker", w)
PY
}
case $1 in
tiny)
  python3 -m storyboard_cli render tiny.yaml --out t1 --device cuda --quiet --json || exit 1
  python3 -m storyboard_cli render tiny.yaml --out t2 --gpus 2 --quiet 2>&1 | tail -3
  cmp_dirs t1 t2; cat t2/report.md | sed -n '/Workers/,$p' ;;
bench)
  # 1 GPU twice at once (GPU 0 and GPU 1: is one GPU's render itself repeatable?), then 2 GPUs
  CUDA_VISIBLE_DEVICES=0 python3 -m storyboard_cli render bench.yaml --out b1 --device cuda --compile off --quiet 2>&1 | tail -2 &
  CUDA_VISIBLE_DEVICES=1 python3 -m storyboard_cli render bench.yaml --out b1x --device cuda --compile off --quiet 2>&1 | tail -2
  wait
  python3 -m storyboard_cli render bench.yaml --out b2 --compile off --gpus 2 --quiet 2>&1 | tail -2
  cmp_dirs b1 b1x pixels-only
  cmp_dirs b1 b2 ;;
esac

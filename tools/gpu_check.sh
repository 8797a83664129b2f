#!/usr/bin/env bash
# Everything the project checks on a CUDA GPU, without network access, in parts that each fit a
# short device call (at most five minutes on an H100/H200): the wheels the machine's image lacks
# come with the checkout (`make device-wheels`, folder .whl/), and every result lands in one folder.
# docs/gpu.md.
#
#   tools/gpu_check.sh OUT [all|tests|probe|bench|race|timeline|memory|peers-a|peers-b]   (make gpu-check OUT=... PART=...)
#
# At most eight files, none in a subfolder (what a lent device machine returns); each command's
# summary line is appended to OUT/summary.txt the moment it ends. Parts, each under its own limits:
#   tests     pytest -m gpu over the files that hold gpu tests, named (JUnit XML): every preset against
#             plain Lightning on the GPU, Fabric, devices; tools/gpu_equivalence.py: the first step that
#             differs from plain, per configuration; tools/cuda_reserve.py and tools/tier_use.py:
#             cuBLAS's workspaces, the GPU tier against the plan
#   probe     offload-strategy probe: pinned host <-> GPU copies and the disk under OUT
#   bench     tools/bench.py --accelerator gpu: plain Lightning beside the tiered modes on the GPU
#   race      tools/gpu_race.py: zero_infinity, 105 MB units, half the blocks frozen, a compute-bound
#             batch, bitwise against the same run under CUDA_LAUNCH_BLOCKING=1
#   timeline  tools/gpu_timeline.py: torch.profiler over 2 steps of a 150M GPT-2 streamed from host
#             memory: streams' busy and overlapped time, the engine's unit times beside the profiler's
#   memory    tools/gpu_memory.py: the allocator's peaks against the plan, 32-true and bf16-mixed,
#             checkpointed blocks, across a forced re-placement
#   peers-a   tools/compare_peers.py: GPT-2 XL at a 16 GiB cap under tiered and FSDP CPU offload
#   peers-b   the same under torchao's CPU offload and DeepSpeed ZeRO-Offload (which compiles its CPU
#             Adam on first use, about a minute)
# all: tests, probe and bench (at most 470 s); each other part is a call of its own.
set -uo pipefail

USAGE="usage: tools/gpu_check.sh OUT [all|tests|probe|bench|race|timeline|memory|peers-a|peers-b]"
OUT=${1:?$USAGE}
PART=${2:-all}
PY=${PYTHON:-python3}
case $PART in all|tests|probe|bench|race|timeline|memory|peers-a|peers-b) ;; *) echo "unknown part '$PART'; $USAGE" >&2; exit 1 ;; esac
mkdir -p "$OUT"
# first, and alone: where there is no GPU every part says so in one line and exits 2
# (without a device node of NVIDIA's driver, or WSL's, there is none, and no need to start Python)
if ! { [ -e /dev/nvidiactl ] || [ -e /dev/dxg ]; } || ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu-check $PART: no CUDA GPU on this machine, nothing checked (the CPU suite is 'make test')." | tee "$OUT/summary.txt"
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error WANDB_MODE=offline WANDB_SILENT=true
status=0
echo "part: $PART" >"$OUT/summary.txt"

run() {  # name, seconds, command...: the command's output in OUT/name.log, its exit status remembered,
    # its summary line appended the moment it ends (a later part that hangs loses nothing)
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 3 "$OUT/$name.log"
    echo "$name.log: exit $rc: $(tail -n 1 "$OUT/$name.log")" >>"$OUT/summary.txt"
    [ $rc -eq 0 ] || { echo "$name: exit $rc (log: $OUT/$name.log)"; status=1; }
}

"$PY" - >"$OUT/environment.txt" 2>&1 <<'PYEOF'
import platform, torch, lightning
print("python", platform.python_version(), "torch", torch.__version__, "lightning", lightning.__version__)
print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
PYEOF
cat "$OUT/environment.txt"
# the carried wheels, for the parts that import them (race, timeline and memory need none); the
# output joins environment.txt: the device returns 8 files at most
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    case $PART in all|tests)
        timeout 60 "$PY" -m pip install --no-index --find-links .whl hydra-core omegaconf antlr4-python3-runtime wandb >>"$OUT/environment.txt" 2>&1 \
            || { echo "installing the carried wheels failed (see $OUT/environment.txt)"; status=1; } ;;
    esac
    case $PART in peers-*)  # where one of them does not install, its row says so
        timeout 60 "$PY" -m pip install --no-index --find-links .whl deepspeed torchao >>"$OUT/environment.txt" 2>&1 \
            || echo "DeepSpeed or torchao did not install: their rows of the peers table will say so (see $OUT/environment.txt)" ;;
    esac
fi

# a hung test stops alone (pytest-timeout is in the GPU image; not needed elsewhere)
per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=90)
case $PART in all|tests)  # every preset against plain Lightning on CUDA, fp32 and bf16-mixed; Fabric; pinned slabs; DHA views
    # the files that hold gpu tests, named: collecting the whole suite stops at any file whose imports the image lacks
    run gpu-tests 140 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rA --continue-on-collection-errors "${per_test[@]}" \
        --junitxml="$OUT/gpu-tests.xml" tests/test_gpu.py tests/test_dha.py tests/test_device.py tests/test_device_timing.py tests/test_gpu_margin.py tests/test_gpu_margin_measured.py tests/test_pools.py tests/test_hydra_configs.py \
        tests/test_copy_streams.py tests/test_numa.py
    run equivalence 60 "$PY" tools/gpu_equivalence.py
    # what CUDA holds beside the tensors, then the GPU tier step by step against the plan (one log: eight files at most)
    run tier-use 40 bash -c "\"$PY\" tools/cuda_reserve.py && \"$PY\" tools/tier_use.py --gpu-memory 16MiB" ;;
esac
case $PART in all|probe)
    run probe 50 "$PY" -m offload_strategy probe --path "$OUT/probe-disk" --size 512MiB
    rm -rf "$OUT/probe-disk" ;;
esac
case $PART in all|bench)  # a 150M-parameter GPT-2: big enough that copies and host updates show beside compute
    run bench 120 "$PY" tools/bench.py --accelerator gpu --layers 12 --width 1024 --batch-size 8 --seq-len 256 --steps 12 --warmup 3 \
        --repeats 1 --precision bf16-mixed --nvme-path "$OUT" ;;
esac
case $PART in race)  # NVMe files under OUT (removed at the end): the disk the probe measures
    run race 280 "$PY" tools/gpu_race.py --nvme-path "$OUT"
    rm -rf "$OUT"/race-nvme-* ;;
esac
case $PART in timeline)
    run timeline 240 "$PY" tools/gpu_timeline.py ;;
esac
case $PART in memory)
    run memory 240 "$PY" tools/gpu_memory.py ;;
esac
# the peers at a 16 GiB cap, two rows a call (each row about 70 s on an H200; DeepSpeed compiles
# its CPU Adam on its first use); the rows' table is written together in docs/benchmarks.md
peers=(--model gpt2_xl --cap 16GiB --steps 5 --warmup 2 --row-timeout 115 --nvme-path "$OUT")
case $PART in peers-a)
    run peers-a 240 "$PY" tools/compare_peers.py "${peers[@]}" --rows tiered fsdp_offload ;;
esac
case $PART in peers-b)
    run peers-b 240 "$PY" tools/compare_peers.py "${peers[@]}" --rows torchao_offload deepspeed_offload ;;
esac

cat "$OUT/summary.txt"
exit $status

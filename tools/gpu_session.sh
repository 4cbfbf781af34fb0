#!/usr/bin/env bash
# One GPU loan's checks (issue 54), prepared so that two calls measure everything docs/benchmarks-gpu.md
# needs: the CUDA tests, int4 against float16 at Llama-3.2-3B shapes (the Triton kernel and tinygemm), the GPU's
# int4 kernels' top-1 agreement with the CPU's on real (the demo model's) weights, lossless decoding on the demo model, and the
# step (CUDA graphs, and each layer compiled) beside transformers' compiled generate, its greedy ids brought back
# against its logits, and what a step's logits cost on their way to the host (pageable against pinned, against
# the ids alone). Each part runs under its
# own timeout (seconds), its log in $OUT (default .work/gpu-session), its end in $OUT/parts.txt; a part that
# fails or times out does not stop the next. Prints each part's tail and the tables.
#
#   PARTS="tests int4 agree demo lossless copy" bash tools/gpu_session.sh   # on the GPU, call 1: at most 6 min 30 s
#   PARTS=step bash tools/gpu_session.sh    # call 2: at most 5 min (both shapes, batch 1 and 8, 1x/2x/5x)
#   SMOKE=1 bash tools/gpu_session.sh       # every part at tiny sizes on the CPU (its test)
#
# On the device machine (2026-11-29/30: its plain `python` is not the one with torch, polygraphy is missing, at
# most 8 files come back from $OUT, a call killed at its 600 s limit returns nothing at all, and the sixth
# loan's one call ran out of part time in the tests and both step parts): carry polygraphy's wheel (`pip
# download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform
# manylinux2014_x86_64 -d .whl polygraphy`, `.whl` in .git/info/exclude and in the call's carry), install it
# with the device README's line, then, with timeout_s 600, once for each PARTS above (the machine stays warm
# between the calls while they follow at once):
#   OUT=/tmp/gs PARTS=... bash tools/gpu_session.sh; cp /tmp/gs/gpu-session.tgz "$OUT"/
# (the script packs its logs and tables into one gpu-session.tgz; the artifacts it builds go elsewhere).
set -u
out=${OUT:-.work/gpu-session}
mkdir -p "$out"
work=$(mktemp -d)  # the artifacts the parts build: not in $OUT, which comes back
py=python  # the interpreter that has torch: on the device machine that is python3, not python
python -c "import torch" 2> /dev/null || py=python3
if [ "${SMOKE:-0}" = 1 ]; then
    device=cpu; archs=tiny-random; big=tiny-random; batches="1"; rounds=1; tokens=4
    tests="tests/runtime/test_torch_quantized.py -k quantize_makes"; lossless="--device cpu --count 2"
    copies="--batch 1 --vocab 64 --rounds 2"
else
    device=cuda; archs="smollm2-360m llama-3.2-1b"; big=llama-3.2-3b; batches="1 8"; rounds=2; tokens=32
    tests="tests/runtime/test_cuda_graphs.py tests/runtime/test_torch_backend.py tests/runtime/test_torch_quantized.py
           tests/runtime/test_torch_tinygemm.py"
    lossless="--device cuda"; copies=""
fi
bench="$py -m tools.bench.gpu --device $device --max-new-tokens $tokens --rounds $rounds"
[ "$device" = cpu ] && bench="$bench --prompt 4 --bandwidth-mib 16 --dtype float32"

part() {  # part NAME LIMIT COMMAND...: run it (unless PARTS names others), keep its log, say how it ended
    local name=$1 limit=$2
    shift 2
    case " ${PARTS:-$name} " in *" ${name%%-*} "*|*" $name "*) ;; *) return ;; esac
    echo "== $name (timeout ${limit}s): $*"
    local began=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    local end="exit $rc after $((SECONDS - began)) s$([ $rc = 124 ] && echo ': timed out')"
    echo "   $end"
    echo "$name: $end" >> "$out/parts.txt"  # (the call's output keeps only its tail)
    tail -n 25 "$out/$name.log"
}

date -u +"%Y-%m-%dT%H:%M:%SZ $(git rev-parse --short HEAD 2>/dev/null)" | tee "$out/when.txt"
$py -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$out/when.txt"
# (the longest parts last; the first five, then the step, each within the device tool's 600 s a call)
jobs=""  # the device machine has pytest-xdist and 16 cores (the fifth loan's tests: 55 s with -n 8)
[ "${SMOKE:-0}" = 1 ] || ! $py -c "import xdist" 2> /dev/null || jobs="-n 8"
part tests 150 $py -m pytest -q -rs $jobs $tests
# weight-only int4 (and int8) against float16, batch 1, the shapes a Jetson's memory-bound regime meets
# (int4-tinygemm: the same blocks on PyTorch's own int4 product, beside the Triton kernel)
part int4 90 $bench --arch $big --batch 1 --speedups 1 2 --weights float int8 int4 int4-tinygemm --no-transformers \
    --out "$out/int4.md"
# the GPU's int4 kernel against the CPU's on real (the demo model's) weights: top-1 agreement, 100 E2E prompts
# (then tinygemm's: bfloat16 scales, zero terms and activations)
agree="$py -m tools.evaluate.agreement --reference '$work/demo-int4' --backend torch --device $device \
    --text data/e2e/devset.csv.gz --column mr --prompts 100 --deterministic --int4-kernel onnxruntime"
part agree 70 bash -c "$py -m export build --out '$work/demo-int4' --weights int4 --dtype float16 -q && \
    $agree --model $device=$work/demo-int4 && $agree --model tinygemm=$work/demo-int4 --torch-int4-kernel tinygemm"
# lossless decoding on the demo model, torch backend, batch 1 and 8
part demo 20 $py -m export build --out "$work/demo" -q
part lossless 40 $py -m tools.bench.lossless "$work/demo" --backend torch $lossless --batch 1 8 --speedups 2 5 \
    --rounds 2 --warmup-rounds 1 --out "$out/lossless.md"
# a decode step's logits to the host: pageable (.cpu()) against pinned (the torch backend's to_host), and the
# greedy rows' ids alone (the argmax on the device)
part copy 20 $py -m tools.bench.host_copy --device $device $copies --out "$out/copy.md"
# the step at full depth and under SkipDecode, as CUDA graphs and with each layer compiled (torch.compile) under
# them, beside transformers' compiled static-cache generate (its eager generate: slower than either, see the docs);
# at full depth the graph steps also with every row's logits to the host (what greedy rows no longer copy)
for arch in $archs; do
    part "step-$arch" 150 $bench --arch $arch --batch $batches --speedups 1 2 5 --peer compiled --compile-steps \
        --out "$out/step-$arch.md"
done
for table in "$out"/*.md; do
    echo "== $(basename "$table")"
    cat "$table"
done
tar czf "$work/gpu-session.tgz" -C "$out" --exclude=gpu-session.tgz . && mv "$work/gpu-session.tgz" "$out"/ && rm -r "$work"
exit 0
